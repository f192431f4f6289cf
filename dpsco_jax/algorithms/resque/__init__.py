"""Paper 002 (Carmon et al.): ReSQue, ball acceleration, parallel and private SCO."""
