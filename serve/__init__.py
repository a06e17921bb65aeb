"""Ray Serve application: target+drafter replicas behind an OpenAI-compatible API."""
