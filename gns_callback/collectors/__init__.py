"""Where small-batch gradient norms come from: one module per method."""
