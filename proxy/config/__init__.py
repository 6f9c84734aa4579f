"""The operator's YAML config: the one place its keys are defined, and how it is read.

* :mod:`.schema`: every key (pydantic, unknown keys refused with their path), loading and
  parsing, the digest a reload compares, and the translation into
  :class:`qos.SchedulerPolicy`.
* :mod:`.pools`: the ``pools:`` keys (which engines serve which models, routing, health)
  and the single ``upstream`` form read as one pool.

The bottom layer: every other subpackage reads its settings from here, so this one knows
none of them.

May import: nothing of the proxy (only :mod:`qos`).
"""
