// SPDX-License-Identifier: Apache-2.0
// Links one translation unit per public header: a non-inline definition in any header
// would be defined in several of them and fail the link.
int main() { return 0; }
