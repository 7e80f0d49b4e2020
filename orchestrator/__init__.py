"""The driver: plan → fan out branches → fuse → result; the CLI; batch; evaluation."""
