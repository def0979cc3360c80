"""offpolicy.integrations"""
