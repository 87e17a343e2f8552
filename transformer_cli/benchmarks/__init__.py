"""``transformer-reference bench``: the timing of each backend side by side (``bench``), the outside engines it
is measured against (``peers``) and the timing rules (``timing``)."""
