"""Paper 004 (Kornowski): DP bilevel optimization. ``localized_gd`` (DP-Loc-GD/SGD, the inner solver), ``plan`` (calibration, events), ``driver`` (Algorithms 1 and 3, the population variant)."""
