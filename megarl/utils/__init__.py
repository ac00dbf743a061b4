"""Small shared utilities: multi-rank launch (`distributed`), atomic directories (`atomic`), name registries (`registry`)."""
