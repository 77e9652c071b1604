"""The durable side of streaming (issue 12): the stream log on Redis Streams, owner leases,
and the mirror that copies an engine's in-memory streams into it. Imported only when a server
is given ``--redis-url``; ``redis`` is the optional ``durable`` extra."""
