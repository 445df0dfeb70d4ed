"""What the tests share: the tiny models (``models``, the one factory), their Hugging Face
checkpoint directories (``checkpoints``), tokenizers, the local Hub (``hub``), the seeds of
randomized tests, the host-sync counter and the NumPy references of the sampling kernels,
the Gemma 4 assistant and the MTP heads' building blocks (``numpy_heads``).

Importable as ``support``: pytest puts ``tests/`` (the folder of the rootdir conftest, which has
no ``__init__.py``) on ``sys.path``; a subprocess or script gets it on its ``PYTHONPATH``.
"""
