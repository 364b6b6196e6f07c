"""The drafters, one per file; `registry.DRAFTERS` names them. Those with trained heads are in `heads/`."""
