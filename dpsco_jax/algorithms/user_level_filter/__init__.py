"""Paper 000 (Lowy, Liu, Asi): user-level DP-SCO with private outlier removal (FILTER)."""
