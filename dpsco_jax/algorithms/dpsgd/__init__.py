"""The DP-SGD baselines (item, user, group level): ``plan`` (data-free plan: relation, public numbers, noise, events) and ``driver`` (the chains and registered drivers)."""
