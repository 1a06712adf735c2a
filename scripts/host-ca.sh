# Sourced by the Dockerfile's RUN lines that reach the network. Behind a TLS-inspecting proxy the image's own
# CA store does not know the proxy's CA: give the build the host's store as the secret `host_ca`
# (`docker build --secret id=host_ca,src=/etc/ssl/certs/ca-certificates.crt`, or compose's HOST_CA_FILE).
# pip, uv, requests and Python's ssl then trust it for that RUN only: a secret is mounted, never copied, so
# nothing of it stays in the image. Without the secret this changes nothing.
host_ca="${HOST_CA_SECRET:-/run/secrets/host_ca}"
if [ -s "$host_ca" ]; then
    export SSL_CERT_FILE="$host_ca" PIP_CERT="$host_ca" REQUESTS_CA_BUNDLE="$host_ca"
    echo "TLS: trusting the host's CA store (the build secret host_ca) for this step"
fi
unset host_ca
