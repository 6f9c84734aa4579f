"""The operator's YAML config: the one place its keys are defined, and how it is read.

* :mod:`.schema`: the config model: every key (pydantic, unknown keys refused with their
  path), and the translation into :class:`qos.SchedulerPolicy`.
* :mod:`.loading`: reading a file or text into the model (errors that name the key and
  never a secret), the command line's ``--upstream``, the digest a reload compares.
* :mod:`.pools`: the ``pools:`` keys (which engines serve which models, routing, health)
  and the single ``upstream`` form read as one pool.

The bottom layer: every other subpackage reads its settings from here, so this one knows
none of them.

May import: nothing of the proxy (only :mod:`qos`).
"""
