"""The built-in drafter kinds, one module each (listed in `specdec.train.registry`)."""
