# Sourced by the scripts that install a tool venv: a venv is set up again only
# when the installing script changed since it last finished.
#   stamp_current VENV SCRIPT   true when VENV was set up by this SCRIPT as it is
#   stamp_write VENV SCRIPT     records that it was
stamp_current() { [[ -f "$1/.setup-stamp" && "$(cat "$1/.setup-stamp")" == "$(sha256sum "$2" | cut -d' ' -f1)" ]]; }
stamp_write() { sha256sum "$2" | cut -d' ' -f1 > "$1/.setup-stamp"; }
