"""A toy algorithm package (``tests/test_algorithm_interface.py``): everything an algorithm is,
in one package, and nothing else."""
