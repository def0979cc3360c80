"""offpolicy.diagnose"""
