"""Drafters with a trained head on the target's features (EAGLE, Medusa, spark) and the head files they load."""
