"""The remote-write receiver: Prometheus remote write 1.0 on the wire (``proto``), ``POST /api/v1/write`` into
a stream store (``server``), the receiver and the source ``serve`` reads (``service``), and the ``remote_write``
block a Prometheus needs (``prometheus_config``), with the fan-out that copies one stream to every shard replica
(``fanout``). The source it feeds is ``sources.remote_write``."""
