"""The kinds of tensor kept in per-unit regions, named once: the settings' (``config.TensorKind``,
``REGION_KINDS``, the kinds a placement may split) and the pure planner's (strings: no settings module)
read them here, in this order (the reports' too)."""

REGION_KIND_NAMES = ("weights", "master_weights", "optimizer_states", "gradients")
"""Each unit's values of these kinds live in one region (in RAM, on SSD or on the device); saved
activations are per micro-batch instead."""
