"""The DP-SGD baselines (item, user, group level): ``plan`` (with ``mf_plan``) and ``driver``."""
