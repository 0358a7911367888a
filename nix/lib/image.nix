# The OCI image configuration of serve-fast / serve-exact (builtins only; golden-tested in nix/tests/golden.nix).
# nix/pkgs/oci.nix hands it to dockerTools.streamLayeredImage.
{
  mode,
  version,
  # the serve program, started as the image's entry point
  entrypoint,
  # a CA bundle for model downloads from the hub
  caBundle,
  port ? 30000,
}:
assert builtins.elem mode [
  "fast"
  "exact"
];
{
  name = "glm53";
  tag = mode;
  config = {
    Entrypoint = [ entrypoint ];
    ExposedPorts."${toString port}/tcp" = { };
    WorkingDir = "/var/lib/glm53";
    Env = [
      # A server bound to loopback inside a container cannot be reached through a published port.
      "GLM53_HOST=0.0.0.0"
      "GLM53_PORT=${toString port}"
      "GLM53_ROOT=/var/lib/glm53"
      # Weights are mounted here (docker run -v DIR:/model:ro); they are never part of the image.
      "GLM53_MODEL_DIR=/model"
      "HOME=/var/lib/glm53"
      "XDG_CACHE_HOME=/var/cache/glm53"
      "TRITON_CACHE_DIR=/var/cache/glm53/triton"
      "TORCHINDUCTOR_CACHE_DIR=/var/cache/glm53/inductor"
      "CUDA_CACHE_PATH=/var/cache/glm53/nv"
      "SSL_CERT_FILE=${caBundle}"
      # libcuda.so.1 and libnvidia-ml.so.1 come from the host driver: the NVIDIA container toolkit mounts them
      # into one of these directories. Programs from Nix ignore /etc/ld.so.cache, so the search path names them.
      "LD_LIBRARY_PATH=/usr/lib64:/usr/lib/x86_64-linux-gnu:/usr/local/nvidia/lib64"
      "NVIDIA_VISIBLE_DEVICES=all"
      "NVIDIA_DRIVER_CAPABILITIES=compute,utility"
    ];
    Labels = {
      "org.opencontainers.image.title" = "glm53 (${mode} mode)";
      "org.opencontainers.image.description" =
        "GLM-5.3-Flash on one 24 GB NVIDIA GPU plus host RAM, behind an OpenAI-compatible API";
      "org.opencontainers.image.version" = version;
      "org.opencontainers.image.licenses" = "Apache-2.0";
    };
  };
}
