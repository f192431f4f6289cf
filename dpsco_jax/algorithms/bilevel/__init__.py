"""Paper 004 (Kornowski): DP bilevel optimization and its inner solver DP-Loc-(S)GD."""
