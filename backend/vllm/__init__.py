"""xmix-lens inside vLLM: the plugin, hook sites in vLLM's model classes, and the site runtime."""
