"""Paper 001 (Ghazi et al.): user-level output perturbation via local deletion sensitivity."""
