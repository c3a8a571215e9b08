"""What every role shares about the run: its parameters (settings.py), their announcement and the check
against it (announcement.py), the run's task rules for verification (validation.py) and the making of one
signed rollout file (producer.py)."""
