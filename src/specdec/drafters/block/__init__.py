"""Block drafters: DFlash and DSpark (one parallel pass of a small drafter over the target's
features), sharing one network and checkpoint format (`network`)."""
