/*
 * A stand-in libnvidia-ml.so.1 for tests: the real pynvml (nvidia-ml-py) loads it through ctypes exactly
 * as it loads NVIDIA's library, so the launcher's NVML wrapper runs its real code path on machines
 * with no GPU.
 *
 * What it simulates comes from a JSON file named by the NVML_STUB_CONFIG environment variable. The
 * file is read again on every call, so a test may rewrite it between calls; numeric fields and the
 * process list may also be given as a list, read in turn on each call for that device (the last value
 * sticks), which lets a sampling test see an idle GPU turn busy. Call counters restart when NVML is
 * initialised again after a full shutdown. tests/nvml_fixtures.py documents the JSON and builds this.
 *
 * Struct layouts follow NVIDIA's nvml.h (CUDA 12.x) and what pynvml passes:
 *   nvmlMemory_t            {total, free, used}
 *   nvmlMemory_v2_t         {version, total, reserved, free, used}, version = sizeof | 2 << 24
 *   nvmlUtilization_t       {gpu, memory}
 *   nvmlProcessInfo_v1_t    {pid, usedGpuMemory}
 *   nvmlProcessInfo_v2_t    {pid, usedGpuMemory, gpuInstanceId, computeInstanceId}
 *   nvmlProcessInfo_t (v3)  same as v2: the 12.535 header briefly appended usedGpuCcProtectedMemory and
 *                           NVIDIA took it out again; current nvml.h and pynvml use the v2 layout.
 *   nvmlPciInfo_t           {busIdLegacy[16], domain, bus, device, pciDeviceId, pciSubSystemId, busId[32]}
 *
 * A driver that hangs: "hang": "nvmlDeviceGetUtilizationRates" (or a list of names) makes that entry point
 * sleep forever (or "hang_s" seconds) before answering, as a real driver stuck in an ioctl would, until a
 * signal kills the process; "hang_after_calls": N lets the first N such calls answer. "crash": a name makes
 * that call die of SIGSEGV, like a broken driver library. (A real hang is uninterruptible sleep, which a user-space library cannot reproduce; the
 * launcher treats both alike: it kills the helper process and does not wait for it.)
 *
 * Build with -DNVML_STUB_LEGACY to leave out the newer entry points entirely (the _v3 process query and
 * nvmlDeviceGetMemoryInfo_v2), as an old driver would: dlsym then fails and pynvml raises
 * NVMLError_FunctionNotFound, which is what the wrapper's fallbacks handle.
 */

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

/* ---- NVML types and codes (values as in nvml.h) ---------------------------------------------------- */

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_RESET_REQUIRED = 16,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

typedef struct nvmlDevice_st {
    int gpu;
    int mig; /* -1 for a full GPU */
} *nvmlDevice_t;

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;
#define NVML_MEMORY_V2_VERSION ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2U << 24U)))

typedef struct {
    unsigned int gpu, memory;
} nvmlUtilization_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_v2_t;

typedef nvmlProcessInfo_v2_t nvmlProcessInfo_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

#define NVML_VALUE_NOT_AVAILABLE_ULL (~0ULL)
#define MAX_GPUS 64
#define MAX_MIG 8

#include "json.h"

/* ---- state ---------------------------------------------------------------------------------------- */

static pthread_mutex_t stub_lock = PTHREAD_MUTEX_INITIALIZER;
static int init_count;
static jval config;
static int config_ok;    /* config holds a usable description */
static int config_owned; /* config was parsed from the file and must be freed */
static struct nvmlDevice_st gpu_handles[MAX_GPUS];
static struct nvmlDevice_st mig_handles[MAX_GPUS][MAX_MIG];
static unsigned mem_calls[MAX_GPUS], util_calls[MAX_GPUS], proc_calls[MAX_GPUS];

static const struct { const char *name; nvmlReturn_t code; } error_names[] = {
    {"UNINITIALIZED", NVML_ERROR_UNINITIALIZED},
    {"INVALID_ARGUMENT", NVML_ERROR_INVALID_ARGUMENT},
    {"NOT_SUPPORTED", NVML_ERROR_NOT_SUPPORTED},
    {"NO_PERMISSION", NVML_ERROR_NO_PERMISSION},
    {"NOT_FOUND", NVML_ERROR_NOT_FOUND},
    {"DRIVER_NOT_LOADED", NVML_ERROR_DRIVER_NOT_LOADED},
    {"TIMEOUT", NVML_ERROR_TIMEOUT},
    {"LIBRARY_NOT_FOUND", NVML_ERROR_LIBRARY_NOT_FOUND},
    {"FUNCTION_NOT_FOUND", NVML_ERROR_FUNCTION_NOT_FOUND},
    {"GPU_IS_LOST", NVML_ERROR_GPU_IS_LOST},
    {"RESET_REQUIRED", NVML_ERROR_RESET_REQUIRED},
    {"LIB_RM_VERSION_MISMATCH", NVML_ERROR_LIB_RM_VERSION_MISMATCH},
    {"UNKNOWN", NVML_ERROR_UNKNOWN},
};

static nvmlReturn_t error_code(jval *v) {
    const char *name = jstr(v, NULL);
    if (!name) return NVML_SUCCESS;
    if (!strncmp(name, "NVML_ERROR_", 11)) name += 11;
    for (size_t k = 0; k < sizeof(error_names) / sizeof(error_names[0]); k++)
        if (!strcmp(error_names[k].name, name)) return error_names[k].code;
    return NVML_ERROR_UNKNOWN;
}

/* Re-read the JSON file. Called with stub_lock held at the start of every entry point. */
static void load_config(void) {
    if (config_owned) jfree(&config);
    memset(&config, 0, sizeof(config));
    config_ok = config_owned = 0;
    const char *path = getenv("NVML_STUB_CONFIG");
    if (!path || !*path) { /* no description: behave like this machine without a driver */
        static char no_library[] = "LIBRARY_NOT_FOUND";
        static char init_error_key[] = "init_error";
        static jval none[1];
        static char *keys[1] = {init_error_key};
        none[0] = (jval){.t = J_STR, .str = no_library};
        config = (jval){.t = J_OBJ, .n = 1, .items = none, .keys = keys};
        config_ok = 1;
        return;
    }
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "nvml_stub: cannot open NVML_STUB_CONFIG=%s\n", path);
        return;
    }
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc(size > 0 ? (size_t)size : 1);
    size_t got = fread(text, 1, size > 0 ? (size_t)size : 0, f);
    fclose(f);
    jparser p = {text, 0, got, 0};
    if (jparse(&p, &config) || p.err || config.t != J_OBJ) {
        fprintf(stderr, "nvml_stub: %s is not a JSON object (error near byte %zu)\n", path, p.i);
        jfree(&config);
        memset(&config, 0, sizeof(config));
    } else {
        config_ok = config_owned = 1;
    }
    free(text);
}

static jval *gpus_array(void) {
    jval *g = jget(&config, "gpus");
    return (g && g->t == J_ARR) ? g : NULL;
}

static int gpu_count(void) {
    jval *g = gpus_array();
    int n = g ? g->n : 0;
    return n > MAX_GPUS ? MAX_GPUS : n;
}

static int function_missing(const char *name) {
    jval *m = jget(&config, "missing_functions");
    for (int k = 0; m && m->t == J_ARR && k < m->n; k++)
        if (!strcmp(jstr(&m->items[k], ""), name)) return 1;
    return 0;
}

static int function_hangs(const char *name) {
    jval *h = jget(&config, "hang");
    if (h && h->t == J_STR) return !strcmp(h->str, name);
    for (int k = 0; h && h->t == J_ARR && k < h->n; k++)
        if (!strcmp(jstr(&h->items[k], ""), name)) return 1;
    return 0;
}

static int function_crashes(const char *name) {
    jval *c = jget(&config, "crash");
    return c && c->t == J_STR && !strcmp(c->str, name);
}

/* Die of SIGSEGV as a broken library would, without leaving a core file in the test's working directory. */
static void crash(void) {
    struct rlimit none = {0, 0};
    setrlimit(RLIMIT_CORE, &none);
    signal(SIGSEGV, SIG_DFL);
    raise(SIGSEGV);
}

/* "hang": sleep (forever, or "hang_s" seconds) with the lock released, then carry on. */
static unsigned hang_calls; /* calls of a "hang" entry point so far, in this process */

static void maybe_hang(const char *name) {
    if (!function_hangs(name)) return;
    if (hang_calls++ < (unsigned)jnum(jget(&config, "hang_after_calls"), 0)) return; /* answer the first N */
    jval *secs = jget(&config, "hang_s");
    double s = (secs && secs->t == J_NUM) ? secs->num : -1;
    pthread_mutex_unlock(&stub_lock);
    if (s < 0) {
        for (;;) pause();
    }
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts)) {}
    pthread_mutex_lock(&stub_lock);
    load_config();
}

#define ENTER(fname)                                                   \
    pthread_mutex_lock(&stub_lock);                                    \
    load_config();                                                     \
    nvmlReturn_t rc_ = NVML_SUCCESS;                                   \
    if (!config_ok) { rc_ = NVML_ERROR_UNKNOWN; goto out_; }           \
    maybe_hang(fname);                                                 \
    if (function_crashes(fname)) crash();                              \
    if (!config_ok) { rc_ = NVML_ERROR_UNKNOWN; goto out_; }           \
    if (function_missing(fname)) { rc_ = NVML_ERROR_FUNCTION_NOT_FOUND; goto out_; }

#define ENTER_INITIALISED(fname)                                       \
    ENTER(fname)                                                       \
    if (init_count <= 0) { rc_ = NVML_ERROR_UNINITIALIZED; goto out_; }

#define FAIL(code) do { rc_ = (code); goto out_; } while (0)

#define LEAVE()                                                        \
    out_:                                                              \
    pthread_mutex_unlock(&stub_lock);                                  \
    return rc_;

/* Resolve a handle into its JSON object (the GPU, or the MIG device) and check injected errors. */
static nvmlReturn_t lookup(nvmlDevice_t h, jval **gpu, jval **mig, int *gi) {
    if (!h) return NVML_ERROR_INVALID_ARGUMENT;
    int is_gpu = h >= &gpu_handles[0] && h < &gpu_handles[MAX_GPUS];
    const char *first_mig = (const char *)mig_handles, *end_mig = first_mig + sizeof(mig_handles);
    int is_mig = (const char *)h >= first_mig && (const char *)h < end_mig;
    if (!is_gpu && !is_mig) return NVML_ERROR_INVALID_ARGUMENT;
    if (h->gpu >= gpu_count()) return NVML_ERROR_INVALID_ARGUMENT;
    *gi = h->gpu;
    *gpu = jat(gpus_array(), h->gpu);
    nvmlReturn_t injected = error_code(jget(*gpu, "error"));
    if (injected) return injected;
    *mig = NULL;
    if (h->mig >= 0) {
        *mig = jat(jget(*gpu, "mig_devices"), h->mig);
        if (!*mig) return NVML_ERROR_INVALID_ARGUMENT;
    }
    return NVML_SUCCESS;
}

static nvmlReturn_t copy_str(char *dst, unsigned int length, const char *src) {
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(dst, src);
    return NVML_SUCCESS;
}

/* ---- entry points ----------------------------------------------------------------------------------- */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    ENTER("nvmlInitWithFlags")
    nvmlReturn_t injected = error_code(jget(&config, "init_error"));
    if (injected) FAIL(injected);
    if (init_count++ == 0) {
        memset(mem_calls, 0, sizeof(mem_calls));
        memset(util_calls, 0, sizeof(util_calls));
        memset(proc_calls, 0, sizeof(proc_calls));
        for (int g = 0; g < MAX_GPUS; g++) {
            gpu_handles[g] = (struct nvmlDevice_st){g, -1};
            for (int m = 0; m < MAX_MIG; m++) mig_handles[g][m] = (struct nvmlDevice_st){g, m};
        }
    }
    LEAVE()
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    ENTER_INITIALISED("nvmlShutdown")
    init_count--;
    LEAVE()
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument Version Mismatch";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    ENTER_INITIALISED("nvmlSystemGetDriverVersion")
    FAIL(copy_str(version, length, jstr(jget(&config, "driver_version"), "550.54.15")));
    LEAVE()
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    ENTER_INITIALISED("nvmlSystemGetNVMLVersion")
    FAIL(copy_str(version, length, jstr(jget(&config, "nvml_version"), "12.550.54.15")));
    LEAVE()
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    ENTER_INITIALISED("nvmlDeviceGetCount_v2")
    if (!count) FAIL(NVML_ERROR_INVALID_ARGUMENT);
    *count = (unsigned int)gpu_count();
    LEAVE()
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    ENTER_INITIALISED("nvmlDeviceGetHandleByIndex_v2")
    if (!device || index >= (unsigned int)gpu_count()) FAIL(NVML_ERROR_INVALID_ARGUMENT);
    nvmlReturn_t injected = error_code(jget(jat(gpus_array(), (int)index), "handle_error"));
    if (injected) FAIL(injected);
    *device = &gpu_handles[index];
    LEAVE()
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    ENTER_INITIALISED("nvmlDeviceGetIndex")
    jval *gpu, *mig;
    int gi;
    nvmlReturn_t rc = lookup(device, &gpu, &mig, &gi);
    if (rc) FAIL(rc);
    if (!index) FAIL(NVML_ERROR_INVALID_ARGUMENT);
    *index = (unsigned int)gi;
    LEAVE()
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    ENTER_INITIALISED("nvmlDeviceGetUUID")
    jval *gpu, *mig;
    int gi;
    nvmlReturn_t rc = lookup(device, &gpu, &mig, &gi);
    if (rc) FAIL(rc);
    char fallback[64];
    snprintf(fallback, sizeof(fallback), "GPU-00000000-0000-0000-0000-%012d", gi);
    FAIL(copy_str(uuid, length, jstr(jget(mig ? mig : gpu, "uuid"), fallback)));
    LEAVE()
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    ENTER_INITIALISED("nvmlDeviceGetName")
    jval *gpu, *mig;
    int gi;
    nvmlReturn_t rc = lookup(device, &gpu, &mig, &gi);
    if (rc) FAIL(rc);
    FAIL(copy_str(name, length, jstr(jget(mig ? mig : gpu, "name"), "NVIDIA Stub GPU")));
    LEAVE()
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    ENTER_INITIALISED("nvmlDeviceGetPciInfo_v3")
    jval *gpu, *mig;
    int gi;
    nvmlReturn_t rc = lookup(device, &gpu, &mig, &gi);
    if (rc) FAIL(rc);
    if (!pci) FAIL(NVML_ERROR_INVALID_ARGUMENT);
    char fallback[32];
    snprintf(fallback, sizeof(fallback), "00000000:%02X:00.0", 0x07 + gi);
    const char *bus_id = jstr(jget(gpu, "pci_bus_id"), fallback);
    memset(pci, 0, sizeof(*pci));
    snprintf(pci->busId, sizeof(pci->busId), "%s", bus_id);
    snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "%s", bus_id + (strlen(bus_id) > 12 ? 4 : 0));
    unsigned int fn = 0;
    sscanf(bus_id, "%x:%x:%x.%x", &pci->domain, &pci->bus, &pci->device, &fn);
    pci->pciDeviceId = 0x20B510DE;
    LEAVE()
}

nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    return nvmlDeviceGetPciInfo_v3(device, pci);
}

/* Memory of a GPU or a MIG device, for the current call; counts one read of the GPU. */
static void memory_now(jval *gpu, jval *mig, int gi, unsigned long long *total, unsigned long long *reserved,
                       unsigned long long *used) {
    jval *src = mig ? mig : gpu;
    unsigned call = mem_calls[gi]++;
    *total = jnum(jseq(jget(src, "memory_total_bytes"), call), 85899345920ULL);
    *reserved = jnum(jseq(jget(src, "memory_reserved_bytes"), call), 0);
    *used = jnum(jseq(jget(src, "memory_used_bytes"), call), 0);
    if (*reserved + *used > *total) *used = *total - *reserved;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    ENTER_INITIALISED("nvmlDeviceGetMemoryInfo")
    jval *gpu, *mig;
    int gi;
    nvmlReturn_t rc = lookup(device, &gpu, &mig, &gi);
    if (rc) FAIL(rc);
    if (!memory) FAIL(NVML_ERROR_INVALID_ARGUMENT);
    unsigned long long total, reserved, used;
    memory_now(gpu, mig, gi, &total, &reserved, &used);
    memory->total = total;
    memory->used = used + reserved; /* v1 counts driver-reserved memory as used */
    memory->free = total - reserved - used;
    LEAVE()
}

#ifndef NVML_STUB_LEGACY
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    ENTER_INITIALISED("nvmlDeviceGetMemoryInfo_v2")
    jval *gpu, *mig;
    int gi;
    nvmlReturn_t rc = lookup(device, &gpu, &mig, &gi);
    if (rc) FAIL(rc);
    if (!memory) FAIL(NVML_ERROR_INVALID_ARGUMENT);
    if (memory->version != NVML_MEMORY_V2_VERSION) FAIL(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    unsigned long long total, reserved, used;
    memory_now(gpu, mig, gi, &total, &reserved, &used);
    memory->total = total;
    memory->reserved = reserved;
    memory->used = used;
    memory->free = total - reserved - used;
    LEAVE()
}
#endif

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    ENTER_INITIALISED("nvmlDeviceGetUtilizationRates")
    jval *gpu, *mig;
    int gi;
    nvmlReturn_t rc = lookup(device, &gpu, &mig, &gi);
    if (rc) FAIL(rc);
    if (mig) FAIL(NVML_ERROR_NOT_SUPPORTED); /* as on real MIG devices */
    if (!utilization) FAIL(NVML_ERROR_INVALID_ARGUMENT);
    jval *g = jget(gpu, "gpu_utilization_pct");
    if (g && g->t == J_NULL) FAIL(NVML_ERROR_NOT_SUPPORTED);
    unsigned call = util_calls[gi]++;
    utilization->gpu = (unsigned int)jnum(jseq(g, call), 0);
    utilization->memory = (unsigned int)jnum(jseq(jget(gpu, "memory_utilization_pct"), call), 0);
    LEAVE()
}

/*
 * The NVML two-call pattern: with *infoCount too small (pynvml first passes 0 and NULL) return
 * INSUFFICIENT_SIZE and the needed count; with no processes return SUCCESS and 0. The first call of
 * each pair moves the device's process sequence on.
 */
static nvmlReturn_t running_processes(nvmlDevice_t device, unsigned int *infoCount, void *infos, size_t stride,
                                      int version) {
    jval *gpu, *mig;
    int gi;
    nvmlReturn_t rc = lookup(device, &gpu, &mig, &gi);
    if (rc) return rc;
    if (!infoCount) return NVML_ERROR_INVALID_ARGUMENT;
    jval *procs = jget(gpu, "processes");
    if (procs && procs->t == J_NULL) return NVML_ERROR_NOT_SUPPORTED;
    if (procs && procs->t == J_ARR && procs->n > 0 && procs->items[0].t == J_ARR) {
        unsigned call = infos ? (proc_calls[gi] ? proc_calls[gi] - 1 : 0) : proc_calls[gi]++;
        procs = jseq(procs, call);
    } else if (!infos) {
        proc_calls[gi]++;
    }
    unsigned int n = (procs && procs->t == J_ARR) ? (unsigned int)procs->n : 0;
    if (*infoCount < n || (n > 0 && !infos)) {
        *infoCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    *infoCount = n;
    for (unsigned int k = 0; k < n; k++) {
        jval *p = &procs->items[k];
        char *slot = (char *)infos + k * stride;
        jval *mem = jget(p, "used_memory_bytes");
        unsigned long long used = (mem && mem->t == J_NULL) ? NVML_VALUE_NOT_AVAILABLE_ULL : jnum(mem, 0);
        if (version == 1) {
            nvmlProcessInfo_v1_t *info = (nvmlProcessInfo_v1_t *)slot;
            info->pid = (unsigned int)jnum(jget(p, "pid"), 0);
            info->usedGpuMemory = used;
        } else {
            nvmlProcessInfo_v2_t *info = (nvmlProcessInfo_v2_t *)slot;
            info->pid = (unsigned int)jnum(jget(p, "pid"), 0);
            info->usedGpuMemory = used;
            info->gpuInstanceId = (unsigned int)jnum(jget(p, "gpu_instance_id"), 0xFFFFFFFFU);
            info->computeInstanceId = (unsigned int)jnum(jget(p, "compute_instance_id"), 0xFFFFFFFFU);
        }
    }
    return NVML_SUCCESS;
}

#ifndef NVML_STUB_LEGACY
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_t *infos) {
    ENTER_INITIALISED("nvmlDeviceGetComputeRunningProcesses_v3")
    FAIL(running_processes(device, infoCount, infos, sizeof(nvmlProcessInfo_t), 3));
    LEAVE()
}
#endif

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_v2_t *infos) {
    ENTER_INITIALISED("nvmlDeviceGetComputeRunningProcesses_v2")
    FAIL(running_processes(device, infoCount, infos, sizeof(nvmlProcessInfo_v2_t), 2));
    LEAVE()
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                  nvmlProcessInfo_v1_t *infos) {
    ENTER_INITIALISED("nvmlDeviceGetComputeRunningProcesses")
    FAIL(running_processes(device, infoCount, infos, sizeof(nvmlProcessInfo_v1_t), 1));
    LEAVE()
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode) {
    ENTER_INITIALISED("nvmlDeviceGetMigMode")
    jval *gpu, *mig;
    int gi;
    nvmlReturn_t rc = lookup(device, &gpu, &mig, &gi);
    if (rc) FAIL(rc);
    if (mig) FAIL(NVML_ERROR_NOT_SUPPORTED);
    if (!currentMode || !pendingMode) FAIL(NVML_ERROR_INVALID_ARGUMENT);
    jval *mode = jget(gpu, "mig_mode");
    if (!mode || mode->t == J_NULL) FAIL(NVML_ERROR_NOT_SUPPORTED); /* pre-Ampere GPUs */
    *currentMode = mode->t == J_BOOL ? (unsigned int)mode->num : (unsigned int)jnum(mode, 0);
    *pendingMode = *currentMode;
    LEAVE()
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    ENTER_INITIALISED("nvmlDeviceGetMaxMigDeviceCount")
    jval *gpu, *mig;
    int gi;
    nvmlReturn_t rc = lookup(device, &gpu, &mig, &gi);
    if (rc) FAIL(rc);
    if (!count) FAIL(NVML_ERROR_INVALID_ARGUMENT);
    jval *migs = jget(gpu, "mig_devices");
    unsigned int n = (migs && migs->t == J_ARR) ? (unsigned int)migs->n : 0;
    *count = (unsigned int)jnum(jget(gpu, "max_mig_devices"), n > 0 ? 7 : 0);
    LEAVE()
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index, nvmlDevice_t *migDevice) {
    ENTER_INITIALISED("nvmlDeviceGetMigDeviceHandleByIndex")
    jval *gpu, *mig;
    int gi;
    nvmlReturn_t rc = lookup(device, &gpu, &mig, &gi);
    if (rc) FAIL(rc);
    if (mig || !migDevice) FAIL(NVML_ERROR_INVALID_ARGUMENT);
    jval *migs = jget(gpu, "mig_devices");
    unsigned int n = (migs && migs->t == J_ARR) ? (unsigned int)migs->n : 0;
    if (index >= n || index >= MAX_MIG) FAIL(NVML_ERROR_NOT_FOUND); /* an empty MIG slot */
    *migDevice = &mig_handles[gi][index];
    LEAVE()
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice) {
    ENTER_INITIALISED("nvmlDeviceIsMigDeviceHandle")
    jval *gpu, *mig;
    int gi;
    nvmlReturn_t rc = lookup(device, &gpu, &mig, &gi);
    if (rc) FAIL(rc);
    if (!isMigDevice) FAIL(NVML_ERROR_INVALID_ARGUMENT);
    *isMigDevice = mig != NULL;
    LEAVE()
}

nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id) {
    ENTER_INITIALISED("nvmlDeviceGetGpuInstanceId")
    jval *gpu, *mig;
    int gi;
    nvmlReturn_t rc = lookup(device, &gpu, &mig, &gi);
    if (rc) FAIL(rc);
    if (!mig) FAIL(NVML_ERROR_INVALID_ARGUMENT); /* only MIG device handles have one */
    if (!id) FAIL(NVML_ERROR_INVALID_ARGUMENT);
    *id = (unsigned int)jnum(jget(mig, "gpu_instance_id"), (unsigned long long)device->mig);
    LEAVE()
}
