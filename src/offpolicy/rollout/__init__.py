"""offpolicy.rollout"""
