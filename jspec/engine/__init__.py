"""The online engine: requests in at any time, text out as rounds are accepted, over a running batch of slots
with paged KV caches and prefix caching. Imports every layer up to `jspec.planning`."""
