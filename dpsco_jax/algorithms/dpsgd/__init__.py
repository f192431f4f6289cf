"""The DP-SGD baselines (item, user, group level): ``plan`` and ``driver``."""
