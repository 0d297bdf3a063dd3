"""Evaluation of drafters against their verifier: measured acceptance by real speculative decoding."""
