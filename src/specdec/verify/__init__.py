"""Verifiers: token-level ("standard"), block, and coupled; temperature-0 rows verify greedily;
`verify_tree` verifies draft trees (standard and coupled; block is chain-only).

`verify` dispatches to the fused Triton kernels on CUDA and to `verify_ref` elsewhere; both take
the same arguments and return the same result (tokens identical on inputs without near-ties).
"""

from specdec.verify.inputs import (
    MAX_POSITION,
    VERIFY_METHODS,
    ValueCheck,
    VerifyInputs,
    VerifyResult,
    check_verify_inputs,
    first_unusable_read_row,
    rows_read,
)
from specdec.verify.tree import TREE_METHODS, TreeVerifyResult, verify_tree
from specdec.verify.tree_inputs import first_unusable_read_depth
from specdec.verify.verifier import verify, verify_checked, verify_checked_ref, verify_ref

__all__ = [
    "MAX_POSITION",
    "TREE_METHODS",
    "VERIFY_METHODS",
    "TreeVerifyResult",
    "ValueCheck",
    "VerifyInputs",
    "VerifyResult",
    "check_verify_inputs",
    "first_unusable_read_depth",
    "first_unusable_read_row",
    "rows_read",
    "verify",
    "verify_checked",
    "verify_checked_ref",
    "verify_ref",
    "verify_tree",
]
