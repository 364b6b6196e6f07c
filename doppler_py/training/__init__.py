"""Training draft heads by self-distillation (torch on CPU; an optional extra: `pip install -e .[train]`)."""
