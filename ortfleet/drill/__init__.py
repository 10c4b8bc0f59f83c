"""Fault drills on a throwaway local fleet: `ortfleet drill kills` and `ortfleet drill chaos`."""
