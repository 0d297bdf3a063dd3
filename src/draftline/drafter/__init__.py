"""What every stage shares about the drafter model: its shape, the model itself, checkpoints and their
layouts, the draft vocabulary, the hand-off between stages, and where a parent comes from."""
