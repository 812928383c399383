"""The learning studies: the shared pieces here, one folder per study (script, arms, results)."""
