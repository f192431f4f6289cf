"""Paper 000 (Lowy, Liu, Asi): user-level DP-SCO with FILTER outlier removal. ``schedules`` (the paper's parameters), ``plan`` (data-free privacy plans), ``driver`` (Algorithms 1-3)."""
