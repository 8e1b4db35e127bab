"""EAGLE / MTP: a one-layer head over the target's features (`head`) and its chain drafter
(`drafter`)."""
