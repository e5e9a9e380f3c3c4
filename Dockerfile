# jobstream services image (relay, stage workers, downstream example).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY jobstream ./jobstream
COPY streams ./streams
COPY consumers ./consumers
COPY schemas ./schemas
COPY outbox_relay ./outbox_relay
COPY scripts ./scripts
RUN pip install --no-cache-dir .
USER nobody
CMD ["jobstream", "--help"]
