"""Verifiers: token-level ("standard"), block, and coupled; temperature-0 rows verify greedily.

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
)
from specdec.verify.verifier import verify, verify_checked, verify_checked_ref, verify_ref

__all__ = [
    "MAX_POSITION",
    "VERIFY_METHODS",
    "ValueCheck",
    "VerifyInputs",
    "VerifyResult",
    "check_verify_inputs",
    "verify",
    "verify_checked",
    "verify_checked_ref",
    "verify_ref",
]
