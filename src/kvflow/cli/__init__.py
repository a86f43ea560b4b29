"""The ``kvflow`` command line: ``doctor``, ``bench``, ``trace``."""
