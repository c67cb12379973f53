/* abi.c -- the library's ABI version (kvcodec/native/abi.py checks it on load). */
#include "kvn_common.h"

/* ABI version: bump KVN_ABI_VERSION when a signature changes (the loader checks it). */
int kvn_abi_version(void) { return KVN_ABI_VERSION; }
