"""Process groups and collectives: the parallel bootstrap and the rank-0-centred helpers.

Below ``models/`` in the floor order (tests/unit/test_architecture.py): model builders,
optimizers and the trainer receive a ``ParallelContext`` from here.
"""
