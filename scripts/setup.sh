#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages the course builds with, if any are missing.
# Used by run_course.sh and run_tests.sh; safe to run again (it installs nothing twice).
set -euo pipefail

packages=(cmake g++ make catch2 libopenblas-dev libdnnl-dev libopenmpi-dev openmpi-bin pkg-config)
# the course report's pictures (tools/report); any gnuplot with the svg terminal will do
if ! command -v gnuplot >/dev/null 2>&1; then packages+=(gnuplot-nox); fi

missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "[setup] installing missing packages: ${missing[*]}"
if [ "$(id -u)" -eq 0 ]; then
  sudo_cmd=()
elif command -v sudo >/dev/null 2>&1; then
  sudo_cmd=(sudo)
else
  echo "[setup] error: need root or sudo to install: ${missing[*]}" >&2
  echo "[setup] hint: ask an administrator to run: apt-get install ${missing[*]}" >&2
  exit 1
fi

export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
