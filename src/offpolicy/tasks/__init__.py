"""offpolicy.tasks"""
