# The systemd sandbox of the project's services (the server's unit, nix/lib/unit.nix; the fleet's router and front
# proxy, nix/lib/router.nix and nix/lib/front-proxy.nix): a dynamic user with no capabilities, no devices, a
# read-only system and the system calls of a plain network service. A unit overrides what it needs
# (`sandbox // { ... }`).
{
  DynamicUser = true;
  UMask = "0077";
  CapabilityBoundingSet = [ "" ];
  NoNewPrivileges = true;
  LockPersonality = true;
  MemoryDenyWriteExecute = true;
  PrivateDevices = true;
  PrivateTmp = true;
  PrivateUsers = true;
  ProcSubset = "pid";
  ProtectClock = true;
  ProtectControlGroups = true;
  ProtectHome = true;
  ProtectHostname = true;
  ProtectKernelLogs = true;
  ProtectKernelModules = true;
  ProtectKernelTunables = true;
  ProtectProc = "invisible";
  ProtectSystem = "strict";
  RemoveIPC = true;
  RestrictAddressFamilies = [
    "AF_INET"
    "AF_INET6"
    "AF_UNIX"
  ];
  RestrictNamespaces = true;
  RestrictRealtime = true;
  RestrictSUIDSGID = true;
  SystemCallArchitectures = "native";
  SystemCallFilter = [
    "@system-service"
    "~@privileged"
  ];
  # a call outside the list fails with EPERM, which Python reports with its name, instead of killing the process
  SystemCallErrorNumber = "EPERM";
}
