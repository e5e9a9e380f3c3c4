# jobstream services image (relay, stage workers, downstream example). Dependencies are the
# exact versions of uv.lock (with their hashes), as in CI and in scripts/venv.sh.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml uv.lock README.md ./
RUN pip install --no-cache-dir 'uv>=0.5' \
 && uv export --frozen --no-emit-project --no-dev -o /tmp/requirements.txt \
 && pip install --no-cache-dir -r /tmp/requirements.txt
COPY jobstream ./jobstream
COPY streams ./streams
COPY consumers ./consumers
COPY schemas ./schemas
COPY outbox_relay ./outbox_relay
COPY scripts ./scripts
RUN pip install --no-cache-dir --no-deps .
USER nobody
CMD ["jobstream", "--help"]
