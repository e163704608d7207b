"""Type stub for the parts of nvidia-ml-py (``pynvml``) that gpufleet uses.

Functions with the argument and return types of their Python wrappers (strings come back as
``str``), constants as ``int``, the ctypes structures with the fields gpufleet reads or
writes, ``NVMLError`` with its ``value`` and the library internals the fake NVML replaces
(``nvmlLib``, ``_nvmlGetFunctionPointer``). Not a complete stub of pynvml: a name missing
here is one gpufleet does not use yet.
"""

import ctypes
import threading
from collections.abc import Callable, Sequence
from typing import overload

# ---------------------------------------------------------------- constants

NVML_AGGREGATE_ECC: int
NVML_CLOCK_GRAPHICS: int
NVML_CLOCK_MEM: int
NVML_CLOCK_SM: int
NVML_CLOCK_VIDEO: int
NVML_DEVICE_ARCH_TURING: int
NVML_DEVICE_ARCH_UNKNOWN: int
NVML_ERROR_ALREADY_INITIALIZED: int
NVML_ERROR_ARGUMENT_VERSION_MISMATCH: int
NVML_ERROR_DRIVER_NOT_LOADED: int
NVML_ERROR_FUNCTION_NOT_FOUND: int
NVML_ERROR_GPU_IS_LOST: int
NVML_ERROR_INSUFFICIENT_SIZE: int
NVML_ERROR_INVALID_ARGUMENT: int
NVML_ERROR_LIBRARY_NOT_FOUND: int
NVML_ERROR_LIB_RM_VERSION_MISMATCH: int
NVML_ERROR_NOT_FOUND: int
NVML_ERROR_NOT_SUPPORTED: int
NVML_ERROR_NO_PERMISSION: int
NVML_ERROR_RESET_REQUIRED: int
NVML_ERROR_TIMEOUT: int
NVML_ERROR_UNINITIALIZED: int
NVML_ERROR_UNKNOWN: int
NVML_FEATURE_DISABLED: int
NVML_FEATURE_ENABLED: int
NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN: int
NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN: int
NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP: int
NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN: int
NVML_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST: int
NVML_FI_DEV_MEMORY_TEMP: int
NVML_FI_DEV_NVLINK_ERROR_DL_CRC: int
NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY: int
NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY: int
NVML_FI_DEV_NVLINK_GET_STATE: int
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: int
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: int
NVML_GPM_METRICS_GET_VERSION: int
NVML_GPM_METRIC_ANY_TENSOR_UTIL: int
NVML_GPM_METRIC_DRAM_BW_UTIL: int
NVML_GPM_METRIC_FP64_UTIL: int
NVML_GPM_METRIC_MAX: int
NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: int
NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: int
NVML_GPM_METRIC_PCIE_RX_PER_SEC: int
NVML_GPM_METRIC_PCIE_TX_PER_SEC: int
NVML_GPM_METRIC_SM_OCCUPANCY: int
NVML_GPM_METRIC_SM_UTIL: int
NVML_GPM_SUPPORT_VERSION: int
NVML_MEMORY_ERROR_TYPE_CORRECTED: int
NVML_MEMORY_ERROR_TYPE_UNCORRECTED: int
NVML_NVLINK_ERROR_DL_CRC_DATA: int
NVML_NVLINK_ERROR_DL_CRC_FLIT: int
NVML_NVLINK_ERROR_DL_ECC_DATA: int
NVML_NVLINK_ERROR_DL_RECOVERY: int
NVML_NVLINK_ERROR_DL_REPLAY: int
NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: int
NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: int
NVML_PCIE_UTIL_RX_BYTES: int
NVML_PCIE_UTIL_TX_BYTES: int
NVML_SUCCESS: int
NVML_TEMPERATURE_GPU: int
NVML_TEMPERATURE_THRESHOLD_COUNT: int
NVML_TEMPERATURE_THRESHOLD_GPU_MAX: int
NVML_TEMPERATURE_THRESHOLD_MEM_MAX: int
NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: int
NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: int
NVML_VALUE_TYPE_DOUBLE: int
NVML_VALUE_TYPE_SIGNED_INT: int
NVML_VALUE_TYPE_SIGNED_LONG_LONG: int
NVML_VALUE_TYPE_UNSIGNED_INT: int
NVML_VALUE_TYPE_UNSIGNED_LONG: int
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: int
NVML_VALUE_TYPE_UNSIGNED_SHORT: int
NVML_VOLATILE_ECC: int
nvmlClocksEventReasonAll: int
nvmlEventTypeXidCriticalError: int
nvmlMemory_v2: int

# ---------------------------------------------------------------- errors

class NVMLError(Exception):
    value: int
    def __init__(self, value: int) -> None: ...

class NVMLError_ArgumentVersionMismatch(NVMLError): ...
class NVMLError_DriverNotLoaded(NVMLError): ...
class NVMLError_FunctionNotFound(NVMLError): ...
class NVMLError_GpuIsLost(NVMLError): ...
class NVMLError_InvalidArgument(NVMLError): ...
class NVMLError_NotFound(NVMLError): ...
class NVMLError_NoPermission(NVMLError): ...
class NVMLError_NotSupported(NVMLError): ...
class NVMLError_ResetRequired(NVMLError): ...
class NVMLError_Timeout(NVMLError): ...
class NVMLError_Uninitialized(NVMLError): ...
class NVMLError_Unknown(NVMLError): ...

# ---------------------------------------------------------------- library internals

#: The loaded libnvidia-ml (None before the first nvmlInit); the fake NVML puts its own object here.
nvmlLib: ctypes.CDLL | None
libLoadLock: threading.Lock
_nvmlGetFunctionPointer_cache: dict[str, Callable[..., int]]

def _nvmlGetFunctionPointer(name: str) -> Callable[..., int]: ...

# ---------------------------------------------------------------- structures

class struct_c_nvmlDevice_t(ctypes.Structure): ...
class c_nvmlDevice_t(ctypes._Pointer[struct_c_nvmlDevice_t]): ...
class struct_c_nvmlEventSet_t(ctypes.Structure): ...
class c_nvmlEventSet_t(ctypes._Pointer[struct_c_nvmlEventSet_t]): ...
class struct_c_nvmlGpmSample_t(ctypes.Structure): ...
class c_nvmlGpmSample_t(ctypes._Pointer[struct_c_nvmlGpmSample_t]): ...

# pynvml's structures (_PrintableStructure) give their char arrays as str.
class nvmlPciInfo_t(ctypes.Structure):
    busIdLegacy: str
    domain: int
    bus: int
    device: int
    pciDeviceId: int
    pciSubSystemId: int
    busId: str

class c_nvmlUtilization_t(ctypes.Structure):
    gpu: int
    memory: int

class c_nvmlMemory_t(ctypes.Structure):
    total: int
    free: int
    used: int

class c_nvmlMemory_v2_t(ctypes.Structure):
    version: int
    total: int
    reserved: int
    free: int
    used: int

class c_nvmlBAR1Memory_t(ctypes.Structure):
    bar1Total: int
    bar1Free: int
    bar1Used: int

class c_nvmlValue_t(ctypes.Union):
    dVal: float
    uiVal: int
    ulVal: int
    ullVal: int
    sllVal: int
    siVal: int
    usVal: int

class c_nvmlFieldValue_t(ctypes.Structure):
    fieldId: int
    scopeId: int
    timestamp: int
    latencyUsec: int
    valueType: int
    nvmlReturn: int
    value: c_nvmlValue_t

class c_nvmlEventData_t(ctypes.Structure):
    device: c_nvmlDevice_t
    eventType: int
    eventData: int
    gpuInstanceId: int
    computeInstanceId: int

class c_metricInfo_t(ctypes.Structure):
    shortName: bytes | None
    longName: bytes | None
    unit: bytes | None

class c_nvmlGpmMetric_t(ctypes.Structure):
    metricId: int
    nvmlReturn: int
    value: float
    metricInfo: c_metricInfo_t

class c_nvmlGpmMetricsGet_t(ctypes.Structure):
    version: int
    numMetrics: int
    sample1: c_nvmlGpmSample_t
    sample2: c_nvmlGpmSample_t
    metrics: ctypes.Array[c_nvmlGpmMetric_t]

class c_nvmlGpmSupport_t(ctypes.Structure):
    version: int
    isSupportedDevice: int

# ---------------------------------------------------------------- functions

def nvmlInit() -> None: ...
def nvmlShutdown() -> None: ...
def nvmlErrorString(result: int) -> str: ...
def nvmlSystemGetDriverVersion() -> str: ...
def nvmlSystemGetNVMLVersion() -> str: ...
def nvmlSystemGetCudaDriverVersion() -> int: ...
def nvmlSystemGetCudaDriverVersion_v2() -> int: ...
def nvmlDeviceGetCount() -> int: ...
def nvmlDeviceGetHandleByIndex(index: int) -> c_nvmlDevice_t: ...
def nvmlDeviceGetIndex(handle: c_nvmlDevice_t) -> int: ...
def nvmlDeviceGetUUID(handle: c_nvmlDevice_t) -> str: ...
def nvmlDeviceGetName(handle: c_nvmlDevice_t) -> str: ...
def nvmlDeviceGetSerial(handle: c_nvmlDevice_t) -> str: ...
def nvmlDeviceGetVbiosVersion(handle: c_nvmlDevice_t) -> str: ...
def nvmlDeviceGetPciInfo(handle: c_nvmlDevice_t) -> nvmlPciInfo_t: ...
def nvmlDeviceGetArchitecture(handle: c_nvmlDevice_t) -> int: ...
def nvmlDeviceGetMinorNumber(handle: c_nvmlDevice_t) -> int: ...
def nvmlDeviceGetCudaComputeCapability(handle: c_nvmlDevice_t) -> tuple[int, int]: ...
def nvmlDeviceGetMaxClockInfo(handle: c_nvmlDevice_t, type: int) -> int: ...
def nvmlDeviceGetClockInfo(handle: c_nvmlDevice_t, type: int) -> int: ...
def nvmlDeviceGetTemperature(handle: c_nvmlDevice_t, sensor: int) -> int: ...
def nvmlDeviceGetTemperatureThreshold(handle: c_nvmlDevice_t, threshold: int) -> int: ...
def nvmlDeviceGetMaxPcieLinkGeneration(handle: c_nvmlDevice_t) -> int: ...
def nvmlDeviceGetMaxPcieLinkWidth(handle: c_nvmlDevice_t) -> int: ...
def nvmlDeviceGetCurrPcieLinkGeneration(handle: c_nvmlDevice_t) -> int: ...
def nvmlDeviceGetCurrPcieLinkWidth(handle: c_nvmlDevice_t) -> int: ...
def nvmlDeviceGetPcieReplayCounter(handle: c_nvmlDevice_t) -> int: ...
def nvmlDeviceGetPcieThroughput(handle: c_nvmlDevice_t, counter: int) -> int: ...
def nvmlDeviceGetNumFans(handle: c_nvmlDevice_t) -> int: ...
def nvmlDeviceGetFanSpeed_v2(handle: c_nvmlDevice_t, fan: int) -> int: ...
def nvmlDeviceGetUtilizationRates(handle: c_nvmlDevice_t) -> c_nvmlUtilization_t: ...
def nvmlDeviceGetEncoderUtilization(handle: c_nvmlDevice_t) -> list[int]: ...
def nvmlDeviceGetPowerUsage(handle: c_nvmlDevice_t) -> int: ...
def nvmlDeviceGetEnforcedPowerLimit(handle: c_nvmlDevice_t) -> int: ...
def nvmlDeviceGetTotalEnergyConsumption(handle: c_nvmlDevice_t) -> int: ...
@overload
def nvmlDeviceGetMemoryInfo(handle: c_nvmlDevice_t) -> c_nvmlMemory_t: ...
@overload
def nvmlDeviceGetMemoryInfo(handle: c_nvmlDevice_t, version: int) -> c_nvmlMemory_v2_t: ...
def nvmlDeviceGetBAR1MemoryInfo(handle: c_nvmlDevice_t) -> c_nvmlBAR1Memory_t: ...
def nvmlDeviceGetPerformanceState(handle: c_nvmlDevice_t) -> int: ...
def nvmlDeviceGetCurrentClocksEventReasons(handle: c_nvmlDevice_t) -> int: ...
def nvmlDeviceGetCurrentClocksThrottleReasons(handle: c_nvmlDevice_t) -> int: ...
def nvmlDeviceGetTotalEccErrors(handle: c_nvmlDevice_t, errorType: int, counterType: int) -> int: ...
def nvmlDeviceGetRemappedRows(device: c_nvmlDevice_t) -> tuple[int, int, int, int]: ...
def nvmlDeviceGetRetiredPages(device: c_nvmlDevice_t, sourceFilter: int) -> list[int]: ...
def nvmlDeviceGetRetiredPagesPendingStatus(device: c_nvmlDevice_t) -> int: ...
def nvmlDeviceGetNvLinkState(device: c_nvmlDevice_t, link: int) -> int: ...
def nvmlDeviceGetNvLinkErrorCounter(device: c_nvmlDevice_t, link: int, counter: int) -> int: ...
def nvmlDeviceGetFieldValues(
    handle: c_nvmlDevice_t, fieldIds: Sequence[int | tuple[int, int]]
) -> ctypes.Array[c_nvmlFieldValue_t]: ...
def nvmlDeviceGetSupportedEventTypes(handle: c_nvmlDevice_t) -> int: ...
def nvmlDeviceRegisterEvents(handle: c_nvmlDevice_t, eventTypes: int, eventSet: c_nvmlEventSet_t) -> None: ...
def nvmlEventSetCreate() -> c_nvmlEventSet_t: ...
def nvmlEventSetFree(eventSet: c_nvmlEventSet_t) -> None: ...
def nvmlEventSetWait_v2(eventSet: c_nvmlEventSet_t, timeoutms: int) -> c_nvmlEventData_t: ...
def nvmlGpmQueryDeviceSupport(device: c_nvmlDevice_t) -> c_nvmlGpmSupport_t: ...
def nvmlGpmSampleAlloc() -> c_nvmlGpmSample_t: ...
def nvmlGpmSampleFree(gpmSample: c_nvmlGpmSample_t) -> None: ...
def nvmlGpmSampleGet(device: c_nvmlDevice_t, gpmSample: c_nvmlGpmSample_t) -> c_nvmlGpmSample_t: ...
def nvmlGpmMigSampleGet(device: c_nvmlDevice_t, gpuInstanceId: int, gpmSample: c_nvmlGpmSample_t) -> c_nvmlGpmSample_t: ...

# ---------------------------------------------------------------- MIG and processes

NVML_DEVICE_MIG_DISABLE: int
NVML_DEVICE_MIG_ENABLE: int
NVML_VALUE_NOT_AVAILABLE_ulonglong: ctypes.c_ulonglong
ProcessesUtilizationInfo_v1: int

class c_nvmlDeviceAttributes(ctypes.Structure):
    multiprocessorCount: int
    gpuInstanceSliceCount: int
    computeInstanceSliceCount: int
    memorySizeMB: int

class c_nvmlProcessUtilizationSample_t(ctypes.Structure):
    pid: int
    timeStamp: int
    smUtil: int
    memUtil: int
    encUtil: int
    decUtil: int

class c_nvmlProcessUtilizationInfo_v1_t(ctypes.Structure):
    timeStamp: int
    pid: int
    smUtil: int
    memUtil: int
    encUtil: int
    decUtil: int
    jpgUtil: int
    ofaUtil: int

class c_nvmlProcessesUtilizationInfo_v1_t(ctypes.Structure):
    version: int
    processSamplesCount: int
    lastSeenTimeStamp: int
    procUtilArray: ctypes._Pointer[c_nvmlProcessUtilizationInfo_v1_t]

class c_nvmlProcessInfo_v2_t(ctypes.Structure):
    pid: int
    usedGpuMemory: int
    gpuInstanceId: int
    computeInstanceId: int

class nvmlFriendlyObject:
    pid: int
    usedGpuMemory: int | None
    gpuInstanceId: int
    computeInstanceId: int

def nvmlDeviceGetMigMode(device: c_nvmlDevice_t) -> list[int]: ...
def nvmlDeviceGetMaxMigDeviceCount(device: c_nvmlDevice_t) -> int: ...
def nvmlDeviceGetMigDeviceHandleByIndex(device: c_nvmlDevice_t, index: int) -> c_nvmlDevice_t: ...
def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(migDevice: c_nvmlDevice_t) -> c_nvmlDevice_t: ...
def nvmlDeviceIsMigDeviceHandle(device: c_nvmlDevice_t) -> ctypes.c_uint: ...
def nvmlDeviceGetGpuInstanceId(device: c_nvmlDevice_t) -> int: ...
def nvmlDeviceGetComputeInstanceId(device: c_nvmlDevice_t) -> int: ...
def nvmlDeviceGetAttributes(device: c_nvmlDevice_t) -> c_nvmlDeviceAttributes: ...
def nvmlDeviceGetAttributes_v2(device: c_nvmlDevice_t) -> c_nvmlDeviceAttributes: ...
def nvmlDeviceGetComputeRunningProcesses(handle: c_nvmlDevice_t) -> list[nvmlFriendlyObject]: ...
def nvmlDeviceGetProcessUtilization(handle: c_nvmlDevice_t, timeStamp: int) -> list[c_nvmlProcessUtilizationSample_t]: ...
def nvmlDeviceGetProcessesUtilizationInfo(
    handle: c_nvmlDevice_t, timeStamp: int
) -> list[c_nvmlProcessUtilizationInfo_v1_t]: ...
def nvmlGpmMetricsGet(metricsGet: c_nvmlGpmMetricsGet_t) -> c_nvmlGpmMetricsGet_t: ...

# ---------------------------------------------------------------- NVLink fabric and rack (Blackwell, issue 21)

nvmlGpuFabricInfo_v2: int
nvmlGpuFabricInfo_v3: int
nvmlPlatformInfo_v1: int
nvmlPlatformInfo_v2: int
nvmlMarginTemperature_v1: int
nvmlNvlinkGetBwMode_v1: int
NVML_GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_NONE: int

class c_nvmlGpuFabricInfo_v2_t(ctypes.Structure):
    version: int
    clusterUuid: ctypes.Array[ctypes.c_uint8]
    status: int
    cliqueId: int
    state: int
    healthMask: int

class c_nvmlGpuFabricInfo_v3_t(c_nvmlGpuFabricInfo_v2_t):
    healthSummary: int

class c_nvmlPlatformInfo_v1_t(ctypes.Structure):
    version: int

class c_nvmlPlatformInfo_v2_t(ctypes.Structure):
    version: int
    ibGuid: bytes | str
    chassisSerialNumber: bytes | str
    slotNumber: bytes | str
    trayIndex: bytes | str
    hostId: bytes | str
    peerType: bytes | str
    moduleId: bytes | str

class c_nvmlNvlinkGetBwMode_v1_t(ctypes.Structure):
    version: int
    bIsBest: int
    bwMode: int

class c_nvmlC2cModeInfo_v1_t(ctypes.Structure):
    isC2cEnabled: int

def nvmlDeviceGetGpuFabricInfoV(device: c_nvmlDevice_t, gpuFabricInfo: object) -> int: ...
def nvmlDeviceGetPlatformInfo(device: c_nvmlDevice_t, platformInfo: object) -> int: ...
def nvmlDeviceGetMarginTemperature(handle: c_nvmlDevice_t) -> int: ...
def nvmlDeviceGetRepairStatus(device: c_nvmlDevice_t) -> list[int]: ...
def nvmlDeviceGetC2cModeInfoV(handle: c_nvmlDevice_t) -> c_nvmlC2cModeInfo_v1_t: ...
def nvmlDeviceGetNvlinkBwMode(device: c_nvmlDevice_t, getBwMode: object) -> int: ...
