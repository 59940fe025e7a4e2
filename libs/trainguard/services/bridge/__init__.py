"""The alert bridge: incidents → Alertmanager, a CloudEvents webhook and Slack."""
