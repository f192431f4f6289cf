"""Paper 003 (Choquette-Choo, Ganesh, Thakurta): Accelerated DP-SRGD; registered in ``driver``."""
