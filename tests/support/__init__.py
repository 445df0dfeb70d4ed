"""What the tests share: the tiny models (``models``, the one factory), their Hugging Face
checkpoint directories (``checkpoints``), tokenizers, the local Hub (``hub``), the seeds of
randomized tests, the host-sync counter and the NumPy references of the sampling kernels and
the Gemma 4 assistant.

Importable as ``support``: pytest puts ``tests/`` (the folder of the rootdir conftest, which has
no ``__init__.py``) on ``sys.path``; a subprocess or script gets it on its ``PYTHONPATH``.
"""
