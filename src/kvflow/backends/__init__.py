"""Device backends: the only code in kvflow that touches memory on a device.

``host`` (CPU tensors, copies on a thread) is the embedded default, ``fake`` is deterministic for
tests, ``cuda`` drives the copy engines through cuda-python. All implement ``base.Backend``.
"""
